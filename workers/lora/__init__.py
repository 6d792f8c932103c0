"""Multi-LoRA on the worker: adapters read from PEFT folders (`adapter.py`), a fixed pool of device slots with an LRU
host cache (`manager.py`, `slots.py`), and the mixed-adapter matmuls every LoRA-able linear layer adds (`punica.py`;
`kernels/lora_sgmv.py` on CUDA)."""
