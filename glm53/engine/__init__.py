"""The serving engine: requests, scheduler (policies), runner, and the Engine API (nano-vllm's split)."""

from glm53.engine.config import DeployConfig
from glm53.engine.engine import Engine
from glm53.engine.request import RequestOutput, SamplingParams

__all__ = ["DeployConfig", "Engine", "RequestOutput", "SamplingParams"]
