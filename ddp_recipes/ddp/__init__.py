"""DistributedDataParallel: the tuned strategy, SyncBatchNorm on CPU and CUDA, comm hooks, failing ranks."""
