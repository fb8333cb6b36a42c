"""Integrations with training frameworks. Each imports its framework lazily, on
first use: ``shardpoint.integrations.deepspeed``."""
