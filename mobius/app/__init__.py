"""The application layer: with the commands (:mod:`mobius.commands`), the only part of ``mobius`` that
uses topology/, partition/ and scheduler/.

* :mod:`mobius.app.settings` -- the machine and the parallel settings, resolved once;
* :mod:`mobius.app.planning` -- the one planning function (``mobius plan`` and ``mobius train``);
* :mod:`mobius.app.run` -- a whole training run in any mode;
* :mod:`mobius.app.rundir` -- the run directory a run claims (lock, ``--overwrite``) and gives back;
* :mod:`mobius.app.launch` -- worker processes of multi-process modes;
* :mod:`mobius.app.supervise` -- the workers mobius starts, under torch's elastic agent, and their signals;
* :mod:`mobius.app.torchrun` -- runs that ``torchrun`` started, and :mod:`mobius.app.rankwatch`, their ranks'
  watch on each other across nodes.
"""
