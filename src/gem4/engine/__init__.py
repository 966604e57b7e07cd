"""Generation engine: requests (sequence.py), policy (scheduler.py), tensors (runner.py), threads (engine.py)."""
from gem4.engine.engine import Engine, EngineClosed, EngineError, Generation, GenerationEvent, Stream
from gem4.engine.runner import NonFiniteLogits
from gem4.engine.sequence import ABORT, LENGTH, STOP, RequestStats
from gem4.sampling import InvalidParameter

__all__ = ["Engine", "EngineClosed", "EngineError", "Generation", "GenerationEvent", "Stream", "RequestStats", "STOP", "LENGTH", "ABORT",
           "InvalidParameter", "NonFiniteLogits"]
