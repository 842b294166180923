"""mobius: fine-tune large Llama, Qwen, Mistral, OPT and GPT-2 checkpoints on commodity PCIe GPU servers."""

__version__ = "0.1.0"
