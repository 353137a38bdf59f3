"""The avest Grafana dashboard, built in Python (see ../build_dashboard.py).

* :mod:`.queries`: PromQL pieces (the sidecar and pair selectors, vLLM metric
  names, the pair picker's query and regex, the stratum selector);
* :mod:`.panels`: the panel, target and variable builders and the grid layout;
* :mod:`.rows_model`: the Overview, Acceptance and Coefficients rows;
* :mod:`.rows_calibration`: the Calibration row (reliability diagram, SVG link);
* :mod:`.rows_strata`: the Strata row (per-stratum slope, calibration, drafts, fallback);
* :mod:`.rows_schedule`: the Draft-length schedule row (lengths per range, goodput);
* :mod:`.rows_service`: the Ingestion and refits and RPC rows.
"""
