"""Exception types. Each says what is wrong and what to do about it."""


class FucinaError(Exception):
    """Base class of every error fucina_jax raises on bad input."""


class GGUFError(FucinaError):
    """The file is not a readable GGUF file (not GGUF, truncated, corrupt)."""


class UnsupportedArchitectureError(FucinaError):
    """`general.architecture` names a model family fucina_jax does not implement."""


class UnsupportedTensorTypeError(FucinaError):
    """A tensor is stored in a quantization type that cannot be dequantized."""


class MissingTensorError(FucinaError):
    """A tensor the architecture needs is absent from the file."""


class TensorShapeError(FucinaError):
    """A tensor's shape disagrees with the shape the metadata implies."""


class MetadataError(FucinaError):
    """A required metadata key is missing or has an impossible value."""


class TokenizerError(FucinaError):
    """The tokenizer metadata is missing or unusable, or the input cannot be encoded."""


class ContextFullError(FucinaError):
    """The prompt (plus generation) does not fit in the context window."""


class SamplerConfigError(FucinaError, ValueError):
    """A sampling parameter is out of range (e.g. top_p outside [0, 1], negative top_k)."""


class DraftIndexError(FucinaError, ValueError):
    """A draft index (fucina_jax.index) got bad input: a token id out of range, too many references, ..."""


class IndexFrozenError(DraftIndexError):
    """Tokens were appended to a frozen suffix automaton (frozen indexes serve external cursors only)."""


class IndexPoisonedError(FucinaError):
    """An append failed (out of memory, token cap reached); the index is poisoned and drafts nothing from now on."""


class ChatTemplateError(FucinaError):
    """A chat template failed to render (syntax error, or the template rejected the conversation)."""


class SpecOptionsError(FucinaError, ValueError):
    """A speculative-decoding option (fucina_jax.speculative.SpecOptions) is out of range or degenerate."""


class RateWindowTooSmall(SpecOptionsError):
    """The cost gate's rolling window holds fewer than 2 verify steps (one verify is too noisy to act on)."""


class ProbeStepsZero(SpecOptionsError):
    """The cost gate's re-probe would run zero verify steps."""


class CostTableEmpty(SpecOptionsError):
    """The cost gate has no verify-cost table entries to price a verify with."""


class ReprobeAfterZero(SpecOptionsError):
    """The cost gate would re-probe after zero disabled steps (use enabled=False to turn speculation off)."""


class DraftSourceError(FucinaError):
    """A draft source broke the DraftSource contract (a draft length or token id out of range)."""


class MeshError(FucinaError, ValueError):
    """The requested device mesh (fucina_jax.sharding.make_mesh) does not fit the visible devices."""


class CostTableError(SpecOptionsError):
    """A verify-cost table file (the --spec-bench JSON, --cost-table FILE) is missing, unreadable or malformed."""


class ChatOptionsError(FucinaError, ValueError):
    """A chat option (fucina_jax.chat.ChatOptions) is invalid, or two options cannot be combined."""


class CacheMemoryError(FucinaError, MemoryError):
    """A KV cache of the requested size does not fit in the machine's memory."""
