"""Generation engine: requests (sequence.py), policy (scheduler.py), tensors (runner.py), threads (engine.py)."""
from gem4.engine.engine import Engine, EngineError, Generation, GenerationEvent, Stream
from gem4.engine.sequence import ABORT, LENGTH, STOP, RequestStats

__all__ = ["Engine", "EngineError", "Generation", "GenerationEvent", "Stream", "RequestStats", "STOP", "LENGTH", "ABORT"]
