"""The asyncio driver of the lease protocol (its twin: ``_sync``)."""
