"""pdserve: a compact LLM serving engine for prefill/decode disaggregation."""
from pdserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; importing it lazily keeps `import pdserve` (and the CLI's --help) fast.
    if name == "LLM":
        from pdserve.llm import LLM
        return LLM
    raise AttributeError(name)
