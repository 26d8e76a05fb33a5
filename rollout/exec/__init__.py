"""Model execution inside the engine process: the model runner, the eager and static-shape (CUDA
graph) runners, forward-batch metadata and the sampler."""
