"""DeepSpeed's ``deepspeed.runtime.fp16`` paths: the fp16 optimizer class names and the loss
scaler."""
