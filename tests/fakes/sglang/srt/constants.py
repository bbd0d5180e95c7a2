"""Memory-occupation tags; cuda_graph exists from 0.5.x on."""

from sglang._profile import at_least

GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
GPU_MEMORY_TYPE_WEIGHTS = "weights"
if at_least("0.5.14"):
    GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
    GPU_MEMORY_ALL_TYPES = [GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_CUDA_GRAPH]
else:
    GPU_MEMORY_ALL_TYPES = [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE]
