"""The avest Grafana dashboard, built in Python (see ../build_dashboard.py).

* :mod:`.queries`: PromQL pieces (selectors, vLLM metric names, survival products);
* :mod:`.panels`: the panel, target and variable builders and the grid layout;
* :mod:`.rows_model`: the Overview, Coefficients, Acceptance and Calibration rows;
* :mod:`.rows_service`: the Ingestion and refits and RPC rows.
"""
