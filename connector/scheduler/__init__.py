"""The scheduler process's half: hit decisions, store planning, storage probes and fetches.

Nothing here touches bytes; what it decides travels to the workers as ``connector.protocol``
records.
"""
