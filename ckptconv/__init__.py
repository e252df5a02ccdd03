"""ckptconv: convert large-model checkpoints to safetensors."""
