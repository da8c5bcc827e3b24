"""The sync driver of the lease protocol (its twin: ``_aio``)."""
