"""The model stage: Llama on the meta device, the loss, and the glue te_llama.py uses."""
