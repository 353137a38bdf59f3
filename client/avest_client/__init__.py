"""Client library for the avest acceptance-estimator service."""
