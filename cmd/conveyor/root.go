package main

import (
	"context"
	"io"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// version is the build's version; `go build -ldflags "-X main.version=…"`
// sets it.
var version = "dev"

// env is what a run takes from its surroundings, so that tests can give
// their own.
type env struct {
	stdin io.Reader
	// stdinTerminal says whether stdin is a terminal: a person who can
	// answer a question, not a pipe or a file to read a payload from.
	stdinTerminal  bool
	stdout, stderr io.Writer
	getenv         func(string) string
	userConfigDir  func() (string, error)
	now            func() time.Time
}

func systemEnv() env {
	return env{stdin: os.Stdin, stdinTerminal: isTerminal(os.Stdin), stdout: os.Stdout, stderr: os.Stderr,
		getenv: os.Getenv, userConfigDir: os.UserConfigDir, now: time.Now}
}

// isTerminal reports whether v is a terminal: a file that is one.
func isTerminal(v any) bool {
	f, ok := v.(interface{ Fd() uintptr })
	return ok && term.IsTerminal(int(f.Fd()))
}

// Output formats.
const (
	outputText = "text"
	outputJSON = "json"
)

// app is one run of the command line: its global flags and, once a
// command needs it, its client of the API.
type app struct {
	env
	flags   configFlags
	output  string
	timeout time.Duration
}

// run runs the command line args and returns how it ended; exitCode
// turns that into the process's exit code.
func run(ctx context.Context, args []string, e env) error {
	a := &app{env: e}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(e.stdin)
	root.SetOut(e.stdout)
	root.SetErr(e.stderr)
	// After SetOut: the completion command writes where the root's output
	// went when it is made.
	strictBuiltins(root)
	cmd, err := root.ExecuteContextC(ctx)
	return classify(cmd, err)
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "conveyor",
		Short: "Submit, watch and manage Conveyor's background tasks",
		Long: `conveyor talks to Conveyor's HTTP API: it submits tasks, shows them and
their events, follows them live, cancels and retries them (one, or every
one a filter matches), shows the org's overview, applies the org's jobs
file (scheduled and triggered jobs, workflows, type limits), triggers and
pauses jobs and types, starts and follows workflow runs, and manages the
org's API keys, users and roles.

The API's URL and the API key come from the flags --url and --token, else
the environment (CONVEYOR_URL; CONVEYOR_TOKEN, or CONVEYOR_KEY as printed
by make run), else the config file (YAML with the keys url and token;
--config, default $XDG_CONFIG_HOME/conveyor/config.yaml), else the
default URL ` + defaultURL + `.

Exit status: 0 on success, 1 when the API refuses or a task does not
complete, 2 when a command is used wrongly, 130 when a task followed to
its end is interrupted (the org's feed, events --follow without an ID,
ends with Ctrl-C and exits 0).`,
		Version:       buildVersion(),
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			if a.output != outputText && a.output != outputJSON {
				return usagef("--output must be text or json, not %q", a.output)
			}
			// A timeout of 0 or less would bound no request at all.
			if a.timeout <= 0 {
				return usagef("--timeout must be positive, got %s", a.timeout)
			}
			return nil
		},
	}
	root.SetVersionTemplate("conveyor {{.Version}}\n")
	pf := root.PersistentFlags()
	a.flags.register(pf)
	pf.StringVarP(&a.output, "output", "o", outputText, "output format: text or json")
	pf.DurationVar(&a.timeout, "timeout", 30*time.Second, "longest a request may take (streams excepted)")
	_ = root.RegisterFlagCompletionFunc("output", fixedCompletions(outputText, outputJSON))

	root.AddGroup(&cobra.Group{ID: "tasks", Title: "Tasks:"}, &cobra.Group{ID: "jobs", Title: "Jobs and type limits:"},
		&cobra.Group{ID: "workflows", Title: "Workflows:"}, &cobra.Group{ID: "admin", Title: "Administration (admin role):"})
	for _, c := range []*cobra.Command{a.submitCommand(), a.getCommand(), a.listCommand(), a.overviewCommand(),
		a.eventsCommand(), a.watchCommand(), a.cancelCommand(), a.retryCommand()} {
		c.GroupID = "tasks"
		root.AddCommand(c)
	}
	for _, c := range []*cobra.Command{a.applyCommand(), a.jobsCommand(), a.typesCommand()} {
		c.GroupID = "jobs"
		root.AddCommand(c)
	}
	for _, c := range []*cobra.Command{a.workflowsCommand(), a.runsCommand(), a.lineageCommand()} {
		c.GroupID = "workflows"
		root.AddCommand(c)
	}
	for _, c := range []*cobra.Command{a.keysCommand(), a.usersCommand(), a.rolesCommand()} {
		c.GroupID = "admin"
		root.AddCommand(c)
	}
	root.AddCommand(a.whoamiCommand())
	markRunErrors(root)
	return root
}

// strictBuiltins makes cobra's own commands refuse what they do not know,
// as the others do: left alone, `completion zhs` writes the usage on
// standard output (into the file a shell's completion was redirected to)
// and `help sumbit` the root's, both with exit 0.
func strictBuiltins(root *cobra.Command) {
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		switch c.Name() {
		case "completion":
			groupCommand(c)
		case "help":
			help := c.Run
			c.RunE = func(cmd *cobra.Command, args []string) error {
				if found, _, err := cmd.Root().Find(args); found == nil || err != nil {
					return usagef("unknown help topic %q", strings.Join(args, " "))
				}
				help(cmd, args)
				return nil
			}
		}
	}
}

// buildVersion is version, or the module's version when the binary was
// built by `go install …@vX`.
func buildVersion() string {
	if version != "dev" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return version
}

// api returns a client of the API, configured by the flags of cmd, the
// environment and the config file.
func (a *app) api(cmd *cobra.Command) (*apiclient.Client, error) {
	cfg, err := loadConfig(cmd.Flags(), a.flags, a.getenv, a.userConfigDir)
	if err != nil {
		// A config file that is missing or wrong is the caller's mistake,
		// as a bad URL is: exit 2.
		return nil, usagef("%v", err)
	}
	c, err := apiclient.New(apiclient.Config{URL: cfg.URL, Token: cfg.Token, Timeout: a.timeout,
		UserAgent: "conveyor-cli/" + buildVersion()})
	if err != nil {
		return nil, usagef("%v", err)
	}
	return c, nil
}

// fixedCompletions completes a flag's value from a fixed list.
func fixedCompletions(values ...string) cobra.CompletionFunc {
	return func(*cobra.Command, []string, string) ([]cobra.Completion, cobra.ShellCompDirective) {
		return values, cobra.ShellCompDirectiveNoFileComp
	}
}
