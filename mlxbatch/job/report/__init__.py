"""What a user reads about a job: report.json (``report``), ``mlxbatch status`` (``status``), ``mlxbatch show``
(``show``) and the run's progress bar (``progress``)."""
