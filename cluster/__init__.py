"""Ray actors, controller, OpenAI router, routing policies, metrics. Arrives with [cluster]."""
