"""The streaming data store where stages meet (see `store` for the why)."""

from asyncflow.transfer_queue.api import Lease, NewSample, QueueClosed, SampleView, StoreClient
from asyncflow.transfer_queue.samplers import balance_by_length, balance_equal_counts, split_sequential
from asyncflow.transfer_queue.store import TransferQueue

__all__ = [
    "Lease",
    "NewSample",
    "QueueClosed",
    "SampleView",
    "StoreClient",
    "TransferQueue",
    "balance_by_length",
    "balance_equal_counts",
    "split_sequential",
]
