"""The model stage: the model on the meta device, the loss, and the glue te_llama.py uses."""
