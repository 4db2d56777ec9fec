"""``elastic-diag analyze``: the same classifier over log files, torchrun log dirs, error files and
flight-recorder dumps, after the fact. No torch.
"""
