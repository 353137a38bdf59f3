"""Who may call what (tokens and roles) and how often (rate buckets, log limits): the adapters' policy."""
