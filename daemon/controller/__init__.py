"""The controller: the brain. Pure decision logic (core, policies) apart from asyncio glue (service)."""
