# Partial stubs for megatron-core 0.16: exactly the API rlcore_megatron uses.
