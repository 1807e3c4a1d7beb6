"""DataModules and the samplers that keep data-parallel evaluation exact."""
