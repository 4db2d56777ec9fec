"""The ``diag+c10d`` rendezvous entry point under its first name (``elastic_diag.rendezvous:handler_factory``):
it lives in :mod:`elastic_diag.launch.rendezvous`."""

from elastic_diag.launch.rendezvous import BACKEND, DiagRendezvousHandler, create_handler, handler_factory

__all__ = ["BACKEND", "DiagRendezvousHandler", "create_handler", "handler_factory"]
