"""The Prometheus metrics: read from the state at scrape time, fed by both adapters."""
