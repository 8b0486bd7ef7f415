"""megakernel: a low-batch decoder for Cohere2-MoE (North Mini Code) with a one-kernel-per-step decode path."""

from megakernel.config import ModelConfig
from megakernel.engine.llm_engine import EngineArgs, LLMEngine
from megakernel.engine.outputs import CompletionOutput, RequestOutput
from megakernel.engine.sampling_params import SamplingParams
from megakernel.errors import MegakernelError
from megakernel.llm import LLM

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput", "ModelConfig",
           "MegakernelError"]
__version__ = "0.1.0"
