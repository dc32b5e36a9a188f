"""The controller: the brain. Pure decision logic (scheduler, policies, ParM's workflow, the
driver) apart from the asyncio glue (service); docs/controller.md walks through the rooms."""
