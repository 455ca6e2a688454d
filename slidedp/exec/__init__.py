"""The executor: real host-streaming training of Hugging Face decoder models, run from the task graph."""
