class MultiprocessingSerializer:
    """ForkingPickler-based (de)serialisation of ``/update_weights_from_tensor`` payloads.

    ``deserialize`` accepts raw bytes or base64 text and unpickles through SGLang's
    ``SafeUnpickler`` (an allow-list of torch rebuild functions)."""

    @staticmethod
    def serialize(obj: object, output_str: bool = False) -> bytes | str: ...
    @staticmethod
    def deserialize(data: bytes | str) -> object: ...
