"""HTTP runtime: an aiohttp server over an engine core running in its own process."""
