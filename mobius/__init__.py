"""mobius: fine-tune large OPT / GPT-2 checkpoints on commodity PCIe GPU servers."""

__version__ = "0.1.0"
