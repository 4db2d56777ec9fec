"""Where a job enters: ``torchrun-diag`` (:mod:`~elastic_diag.launch.run`), the one copy of torch's
``launch_agent`` (:mod:`~elastic_diag.launch.launcher`), the ``diag+c10d`` rendezvous handler for
plain torchrun (:mod:`~elastic_diag.launch.rendezvous`), and the session set-up all three share
(:mod:`~elastic_diag.launch.setup`).
"""
