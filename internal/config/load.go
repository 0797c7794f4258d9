package config

import (
	"fmt"

	"github.com/kelseyhightower/envconfig"
)

// Load reads a configuration struct from the environment and validates it.
// Errors name the variable at fault.
func Load[C interface{ Validate() error }]() (C, error) {
	var c C
	if err := envconfig.Process("", &c); err != nil {
		return c, fmt.Errorf("configuration: %w", err)
	}
	if err := c.Validate(); err != nil {
		return c, fmt.Errorf("configuration: %w", err)
	}
	return c, nil
}
