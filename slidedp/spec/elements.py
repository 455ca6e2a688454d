"""Sizes every layer agrees on: the bytes per element of each tensor the method moves or keeps,
and the tokens of one chunk of the loss. The graph sizes its tasks, the model its memory and the
executor its buffers with these, so that the three count the same bytes."""

PARAM_BYTES = 2  # BF16 on the wire (q in method.md section 3)
GRAD_BYTES = 2  # BF16 gradients on the GPU (what REDUCE moves)
FP32_BYTES = 4  # the master, the moments and the gradient the CPU update reads
LOSS_CHUNK_TOKENS = 2048  # tokens whose FP32 logits the chunked loss holds at a time
MOMENT_QBLOCK = 256  # elements per block of int8 moments, each block with an FP32 absmax
