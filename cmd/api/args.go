package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"regexp"
	"strings"

	"github.com/conveyorhq/conveyor/internal/task"
)

// bootstrapFlags are the arguments of `api bootstrap`.
type bootstrapFlags struct {
	org, name string
}

// commandArgs answers the arguments that follow `api migrate` or `api
// bootstrap` before anything touches the database: done, with the exit
// code, when they ask for help or are wrong. Without it `api migrate -h`
// would create and migrate a database, and a stray word after either
// command would be ignored instead of refused.
func commandArgs(cmd string, args []string, stdout, stderr io.Writer) (b bootstrapFlags, code int, done bool) {
	switch cmd {
	case "migrate":
		if len(args) == 0 {
			return b, 0, false
		}
		switch args[0] {
		case "-h", "-help", "--help", "help":
			_, _ = fmt.Fprint(stdout, usage)
			return b, 0, true
		}
		fmt.Fprintf(stderr, "api migrate: unknown argument %q (it takes none; the database is DATABASE_URL's)\n\n%s", args[0], usage)
		return b, 2, true
	case "bootstrap":
		fs := flag.NewFlagSet("api bootstrap", flag.ContinueOnError)
		fs.SetOutput(stderr)
		org := fs.String("org", "", "the org's slug ("+task.SlugPattern+"); made if missing")
		name := fs.String("name", "bootstrap", "the new admin key's name")
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) { // -h: the flag set printed the usage
				return b, 0, true
			}
			return b, 2, true // the flag set printed the error and the usage
		}
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "api bootstrap: unknown argument %q (it takes only --org and --name)\n", fs.Arg(0))
			fs.Usage()
			return b, 2, true
		}
		if !regexp.MustCompile(task.SlugPattern).MatchString(*org) {
			fmt.Fprintf(stderr, "api bootstrap: --org: give the org's slug, matching %s\n", task.SlugPattern)
			return b, 2, true
		}
		// As the API checks a key's name: else a name the database refuses
		// fails only after the database was created and migrated.
		keyName := strings.TrimSpace(*name)
		if keyName == "" || len(keyName) > 200 || task.CleanText(keyName, 200) != keyName {
			fmt.Fprintf(stderr, "api bootstrap: --name: give the key's name, 1 to 200 characters of UTF-8 text without NUL\n")
			return b, 2, true
		}
		return bootstrapFlags{org: *org, name: keyName}, 0, false
	}
	return b, 0, false
}
