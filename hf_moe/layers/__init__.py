from .block import SparseMoeBlock
from .experts import Experts
from .router import ROUTERS, Router, RouterOutput, TopKRouter, build_router, register_router

__all__ = ["ROUTERS", "Experts", "Router", "RouterOutput", "SparseMoeBlock", "TopKRouter", "build_router",
           "register_router"]
