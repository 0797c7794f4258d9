// Package cli is the few lines every binary's main shares: read the
// configuration, run until SIGINT or SIGTERM, exit non-zero on error.
package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/conveyorhq/conveyor/internal/config"
)

// Service is Main for a service's own process (api, relay, worker), which
// is configured by the environment and takes no arguments but `healthcheck
// URL`: -h, --help or help prints usage on stdout and exits 0, and any other
// argument is refused with usage and exit 2 — never ignored, so that
// `api --help` does not start a server.
func Service[C interface{ Validate() error }](name, usage string, run func(context.Context, C, io.Writer) error) {
	if code, done := serviceArgs(filepath.Base(os.Args[0]), os.Args[1:], usage, os.Stdout, os.Stderr); done {
		os.Exit(code)
	}
	Main(name, run)
}

// serviceArgs answers the arguments of a service's process: done, with the
// exit code, when they ask for help or are not the service's; not done when
// there are none (run the service) or they are `healthcheck …` (Main's).
func serviceArgs(prog string, args []string, usage string, stdout, stderr io.Writer) (code int, done bool) {
	if len(args) == 0 || args[0] == "healthcheck" {
		return 0, false
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		_, _ = fmt.Fprint(stdout, usage)
		return 0, true
	}
	fmt.Fprintf(stderr, "%s: unknown argument %q (the configuration is read from environment variables)\n\n%s", prog, args[0], usage)
	return 2, true
}

// Main loads C from the environment and calls run with a context cancelled
// on SIGINT or SIGTERM. It never returns.
//
// `<binary> healthcheck URL` instead probes URL and exits 0 when it answers
// 200: a container healthcheck for images that hold no curl.
func Main[C interface{ Validate() error }](name string, run func(context.Context, C, io.Writer) error) {
	if len(os.Args) > 1 && os.Args[1] == "healthcheck" {
		os.Exit(healthcheck(os.Args[2:], os.Stdout, os.Stderr))
	}
	cfg, err := config.Load[C]()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = run(ctx, cfg, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// healthcheckUsage is what `healthcheck -h` prints, and what a wrong call
// of it is answered with.
const healthcheckUsage = "usage: healthcheck URL (such as http://localhost:8080/readyz)\n"

// healthcheck GETs the one URL it is given and returns the exit code.
func healthcheck(args []string, stdout, stderr io.Writer) int {
	if len(args) == 1 {
		switch args[0] {
		case "-h", "-help", "--help", "help":
			_, _ = fmt.Fprint(stdout, healthcheckUsage)
			return 0
		}
	}
	if len(args) != 1 {
		_, _ = fmt.Fprint(stderr, healthcheckUsage)
		return 2
	}
	// Anything but an http(s) URL is a wrong call (exit 2), not a service
	// that failed to answer (exit 1).
	u, err := url.Parse(args[0])
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		fmt.Fprintf(stderr, "healthcheck: %q is not an http(s) URL\n%s", args[0], healthcheckUsage)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, args[0], nil)
	if err != nil {
		_, _ = fmt.Fprintln(stderr, "healthcheck:", err)
		return 2
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		_, _ = fmt.Fprintln(stderr, "healthcheck:", err)
		return 1
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = fmt.Fprintln(stderr, "healthcheck:", resp.Status)
		return 1
	}
	return 0
}
