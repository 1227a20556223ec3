# Partial stubs for SGLang 0.5.x: only what rlcore's code and tests touch. rlcore's client speaks
# HTTP and never imports sglang; the tests import these to check our wire format against SGLang's
# own parsers.

__version__: str
