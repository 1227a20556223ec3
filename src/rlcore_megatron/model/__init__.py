"""Megatron's model of a Hugging Face family: the architecture read from ``config.json``
(:mod:`~rlcore_megatron.model.arch`, which imports no Megatron), the GPT model built from it
(:mod:`~rlcore_megatron.model.gpt`) with its mixture-of-experts parts
(:mod:`~rlcore_megatron.model.moe`), and the weights between the two formats
(:mod:`~rlcore_megatron.model.hf_weights`, :mod:`~rlcore_megatron.model.weight_map`)."""
