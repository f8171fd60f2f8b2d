"""Tensor-parallel identity, collectives and rank processes."""

from freetoken.distributed.bootstrap import MainModuleError
from freetoken.distributed.comm import Communicator, get_communicator, set_communicator
from freetoken.distributed.failures import RankError, RankTimeout
from freetoken.distributed.launch import RankGroup, close_all_groups, preload_in_ranks
from freetoken.distributed.placement import Placement, PlacementError, choose_placement
from freetoken.distributed.signals import Terminated, stop_on_signals
from freetoken.distributed.tpinfo import (
    TPInfo,
    acting_as,
    divide,
    get_tp_info,
    reset_tp_info,
    set_tp_info,
)
from freetoken.distributed.worker import RankContext

__all__ = [
    "Communicator", "get_communicator", "set_communicator", "RankContext", "RankError",
    "RankGroup", "RankTimeout", "Placement", "PlacementError", "choose_placement", "TPInfo",
    "acting_as", "divide", "get_tp_info", "reset_tp_info", "set_tp_info", "close_all_groups",
    "Terminated", "stop_on_signals", "MainModuleError", "preload_in_ranks",
]
