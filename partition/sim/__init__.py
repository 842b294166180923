"""The pipeline simulator's mechanisms, one module each; :mod:`partition.simulate` is its entry (``simulate``,
``with_spread``), and :func:`partition.sim.event_loop.run_schedule` runs any schedule's lists (the round-robin's
too, :mod:`partition.roundrobin_plan`).

* :mod:`~partition.sim.event_loop` -- the loop: start what is ready, share, jump to the next completion.
* :mod:`~partition.sim.clock` -- now, the step, and what may let a held upload go.
* :mod:`~partition.sim.worker_lists` -- a worker's action list per engine, and its engines' state in a step.
* :mod:`~partition.sim.compute_streams` -- the compute streams, and each compute's time (drawn or mean).
* :mod:`~partition.sim.transfers` -- the copy threads, download streams and activations between workers.
* :mod:`~partition.sim.flows` -- link and root-complex sharing of the transfers in flight.
* :mod:`~partition.sim.host_sharing` -- the host's CPU and memory shared by the workers' host threads.
* :mod:`~partition.sim.updates` -- the optimizer threads: CPU updates, compute copies, which weights are ready.
* :mod:`~partition.sim.gradient_sums` -- gradients once down: the summing threads, the tied sum, a step's reduce.
* :mod:`~partition.sim.recorder` and :mod:`~partition.sim.result` -- what a simulation records and reports.
* :mod:`~partition.sim.timeline` -- the spans' tracks, drawn as text or written as a Chrome trace.
"""
