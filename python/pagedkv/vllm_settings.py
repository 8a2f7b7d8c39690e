"""The settings the vLLM plugin (``pagedkv.vllm``) and its backend (``pagedkv.vllm_backend``) share.

Neither of those two modules imports the other: the plugin names the backend by its class path
only, and both read these names from here. Imports nothing (vLLM loads the plugin in every process).
"""

# PAGEDKV_VLLM=1 routes vLLM's attention to pagedkv; anything else leaves vLLM's own backends.
ENABLE_VARIABLE = "PAGEDKV_VLLM"
# What vLLM resolves when the switch is on (pagedkv.vllm registers it).
BACKEND_CLASS_PATH = "pagedkv.vllm_backend.PagedKVAttentionBackend"
# pagedkv pages may hold any number of tokens; vLLM's configurable block sizes go up to 256.
MAX_BLOCK_SIZE = 256
