package main

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"
)

// defaultURL is where `make run` serves the API.
const defaultURL = "http://localhost:8080"

// config is where the API is and who the caller is, resolved once per run:
// a flag wins over the environment, which wins over the config file, which
// wins over the default.
type config struct {
	URL   string `yaml:"url"`
	Token string `yaml:"token"`
}

// configFlags are the global flags that configure the client.
type configFlags struct {
	url, token, file string
}

func (f *configFlags) register(flags *pflag.FlagSet) {
	flags.StringVar(&f.url, "url", "", "the API's base URL (env CONVEYOR_URL; default "+defaultURL+")")
	flags.StringVar(&f.token, "token", "", "the bearer token, an API key (env CONVEYOR_TOKEN or CONVEYOR_KEY)")
	flags.StringVar(&f.file, "config", "", "the config file, YAML with keys url and token (default $XDG_CONFIG_HOME/conveyor/config.yaml)")
}

// loadConfig resolves the configuration from the flags, the environment
// (getenv) and the config file: the one --config names, which must exist,
// or config.yaml in userConfigDir()/conveyor, which may not.
func loadConfig(flags *pflag.FlagSet, f configFlags, getenv func(string) string, userConfigDir func() (string, error)) (config, error) {
	var c config
	path, required := f.file, flags.Changed("config")
	if !required {
		if dir, err := userConfigDir(); err == nil && dir != "" {
			path = filepath.Join(dir, "conveyor", "config.yaml")
		}
	}
	if path != "" {
		file, err := readConfigFile(path)
		switch {
		case err == nil:
			c = file
		case required || !errors.Is(err, fs.ErrNotExist):
			return config{}, err
		}
	}
	c.URL = cmp.Or(flagValue(flags, "url", f.url), getenv("CONVEYOR_URL"), c.URL, defaultURL)
	c.Token = cmp.Or(flagValue(flags, "token", f.token), getenv("CONVEYOR_TOKEN"), getenv("CONVEYOR_KEY"), c.Token)
	return c, nil
}

// readConfigFile reads a config file; a key it does not know is an error,
// so that a misspelt one is not silently ignored.
func readConfigFile(path string) (config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return config{}, fmt.Errorf("config file: %w", err)
	}
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(b)).Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return config{}, nil
		}
		return config{}, fmt.Errorf("config file %s: %w", path, err)
	}
	if len(doc.Content) == 0 { // comments only
		return config{}, nil
	}
	// The keys are checked here, rather than by the decoder's KnownFields,
	// so that a mistake is told in the file's terms, not in Go's.
	m := doc.Content[0]
	if m.Kind != yaml.MappingNode {
		return config{}, fmt.Errorf("config file %s: line %d: want the keys url and token, such as url: http://localhost:8080", path, m.Line)
	}
	for i := 0; i < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		if k.Value != "url" && k.Value != "token" {
			return config{}, fmt.Errorf("config file %s: line %d: unknown key %q (the keys are url and token)", path, k.Line, k.Value)
		}
		if v.Kind != yaml.ScalarNode {
			example := "url: " + defaultURL
			if k.Value == "token" {
				example = "token: cvk_…"
			}
			return config{}, fmt.Errorf("config file %s: line %d: %s must be a string, such as %s", path, v.Line, k.Value, example)
		}
	}
	var c config
	if err := doc.Decode(&c); err != nil {
		return config{}, fmt.Errorf("config file %s: %w", path, err)
	}
	return c, nil
}

// flagValue is v when the flag was given, else "".
func flagValue(flags *pflag.FlagSet, name, v string) string {
	if flags.Changed(name) {
		return v
	}
	return ""
}
