"""Admission: the router's length-bucketed queue, budgets and backpressure."""

from router.admission.controller import Admission, Lease
from router.admission.queue import AdmissionQueue

__all__ = ["Admission", "AdmissionQueue", "Lease"]
