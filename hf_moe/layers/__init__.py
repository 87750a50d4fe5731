from .block import SparseMoeBlock
from .experts import Experts
from .router import TopKRouter

__all__ = ["Experts", "SparseMoeBlock", "TopKRouter"]
