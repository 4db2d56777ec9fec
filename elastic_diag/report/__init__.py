"""What a person or a tool reads: report.json (:mod:`~elastic_diag.report.document`, its schema in
``schemas/``), the run's record that writes it (:mod:`~elastic_diag.report.session`), the terminal
summary, report.html, and the generated signature pages. No torch.
"""
