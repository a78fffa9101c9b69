"""LoRA adapters on the torch side: PEFT checkpoints read and checked (``peft``), the
batched shrink/expand of many adapters in one step (``ops``), the device slots and their
host cache (``slots``) and the hooks that add each row's adapter to the projections
(``runtime``)."""
