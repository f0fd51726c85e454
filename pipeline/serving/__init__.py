"""A Pareto pick as a served image classifier: ``model`` is the MLflow pyfunc (images in, class names out),
``publish`` logs and registers it, ``app`` is MLflow's scoring server with one-line errors, ``server`` runs
it (``pipeline serve``). Nothing is imported here: a serving process loads ``model`` alone."""
