"""The CPU backend's switch for oneDNN-repacked linear weights (vllm/_custom_ops.py); not loaded by `import vllm`."""

_supports_onednn = True
