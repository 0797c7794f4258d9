package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/conveyorhq/conveyor/internal/apiclient"
	"github.com/conveyorhq/conveyor/internal/job"
)

// stdinName names standard input in the lines that point at a mistake.
const stdinName = "<stdin>"

func (a *app) applyCommand() *cobra.Command {
	var (
		file string
		opts apiclient.ApplyOptions
	)
	cmd := &cobra.Command{
		Use:   "apply -f FILE",
		Short: "Make the org's jobs and type limits what a jobs file says",
		Long: `Apply a jobs file, YAML or JSON (-f - for standard input): create the jobs
and type limits it declares that the org lacks, update those that differ,
and with --prune delete those it leaves out. The changes are listed, one
line each: + created, ~ updated (each field, old → new), = unchanged,
- deleted. --dry-run lists them and changes nothing.

The file is checked here before it is sent: every mistake is printed as
FILE:LINE:COLUMN: PATH: MESSAGE, and nothing is sent or changed. The API
checks it again (it knows the limits of the org), and applies all of it
or none.

Applying needs the admin role.`,
		Example: `  conveyor apply -f jobs.yaml --dry-run
  conveyor apply -f jobs.yaml
  conveyor apply -f jobs.yaml --prune -o json
  generate-jobs | conveyor apply -f -`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			name, data, err := a.readJobsFile(cmd.Context(), file)
			if err != nil {
				return err
			}
			if _, err := job.Parse(data); err != nil {
				if problems, ok := errors.AsType[job.Problems](err); ok {
					return a.fileMistakes(name, problems, "nothing was sent")
				}
				return fmt.Errorf("%s: %w", name, err)
			}
			c, err := a.api(cmd)
			if err != nil {
				return err
			}
			res, err := c.Apply(cmd.Context(), data, opts)
			if e, ok := errors.AsType[*apiclient.Error](err); ok && len(e.Problems) > 0 {
				return a.fileMistakes(name, e.Problems, "nothing was applied")
			}
			if err != nil {
				return err
			}
			if a.output == outputJSON {
				return writeJSON(a.stdout, res.JSON())
			}
			_, err = fmt.Fprint(a.stdout, job.Format(res.Changes)+applySummary(res.Changes, res.DryRun)+"\n")
			return err
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "file", "f", "", "the jobs file, YAML or JSON (- for standard input)")
	f.BoolVar(&opts.DryRun, "dry-run", false, "list the changes and make none")
	f.BoolVar(&opts.Prune, "prune", false, "delete the jobs and type limits the file leaves out")
	_ = cmd.MarkFlagRequired("file")
	_ = cmd.MarkFlagFilename("file", "yaml", "yml", "json")
	return cmd
}

// readJobsFile reads the file -f names, or standard input for -, and
// returns the name its mistakes are shown under.
func (a *app) readJobsFile(ctx context.Context, file string) (string, []byte, error) {
	var data []byte
	var err error
	name := file
	if file == "-" {
		name = stdinName
		data, err = readAll(ctx, func() ([]byte, error) { return io.ReadAll(a.stdin) })
	} else {
		data, err = readAll(ctx, func() ([]byte, error) { return os.ReadFile(file) })
	}
	if err != nil {
		return name, nil, fmt.Errorf("read the jobs file: %w", err)
	}
	return name, data, nil
}

// fileMistakes prints each mistake of the file called name on a line of
// its own, as compilers do, and returns the error that ends the command.
func (a *app) fileMistakes(name string, problems job.Problems, outcome string) error {
	var b strings.Builder
	for _, p := range problems {
		b.WriteString(problemLine(name, p) + "\n")
	}
	if _, err := io.WriteString(a.stderr, b.String()); err != nil {
		return err
	}
	s := "s"
	if len(problems) == 1 {
		s = ""
	}
	return fmt.Errorf("%s has %d mistake%s; %s", name, len(problems), s, outcome)
}

// problemLine is "jobs.yaml:7:5: jobs[1].source.schedule: message",
// leaving out what is unknown.
func problemLine(name string, p job.Problem) string {
	var b strings.Builder
	b.WriteString(name)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
		if p.Column > 0 {
			fmt.Fprintf(&b, ":%d", p.Column)
		}
	}
	b.WriteString(": ")
	if p.Path != "" {
		b.WriteString(p.Path + ": ")
	}
	b.WriteString(p.Message)
	return b.String()
}

// applySummary counts the changes: "3 created, 1 updated, 2 unchanged",
// or for a dry run "(dry run) would create 3, update 1; 2 unchanged".
func applySummary(changes []job.Change, dryRun bool) string {
	n := map[job.Op]int{}
	for _, c := range changes {
		n[c.Op]++
	}
	ops := []struct {
		op         job.Op
		verb, done string
	}{
		{job.OpCreate, "create", "created"},
		{job.OpUpdate, "update", "updated"},
		{job.OpDelete, "delete", "deleted"},
	}
	var parts []string
	for _, o := range ops {
		if k := n[o.op]; k > 0 {
			if dryRun {
				parts = append(parts, fmt.Sprintf("%s %d", o.verb, k))
			} else {
				parts = append(parts, fmt.Sprintf("%d %s", k, o.done))
			}
		}
	}
	unchanged := n[job.OpUnchanged]
	if !dryRun {
		if unchanged > 0 {
			parts = append(parts, fmt.Sprintf("%d unchanged", unchanged))
		}
		if len(parts) == 0 {
			return "nothing to apply: the file declares no job and no type limit"
		}
		return strings.Join(parts, ", ")
	}
	s := "(dry run) nothing would change"
	if len(parts) > 0 {
		s = "(dry run) would " + strings.Join(parts, ", ")
	}
	if unchanged > 0 {
		s += fmt.Sprintf("; %d unchanged", unchanged)
	}
	return s
}
